"""The plan: the records of every site's outcome, the receipt's sentences and environment, save and load."""
