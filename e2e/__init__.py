"""End-to-end scenarios of pgherd, written once against a driver (see e2e/driver.py and docs/e2e.md)."""
