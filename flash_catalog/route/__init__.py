"""Route: what a bound call runs (runners, the route table) and the opaque custom ops compiled code calls."""
