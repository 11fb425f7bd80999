"""Models, cases and runs that several test files share; no test file imports another."""
