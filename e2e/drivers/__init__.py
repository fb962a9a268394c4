"""Platform drivers for the e2e scenarios: `local` (the pgherd sandbox) and `kind` (kubectl and Helm)."""
