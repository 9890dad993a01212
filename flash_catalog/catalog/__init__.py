"""The catalog: spec records and their TOML reader, the loaded catalog, profiles, implementations, spec checks."""
