"""verl."""
