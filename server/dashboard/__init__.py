"""The live dashboard (`GET /dashboard`), the JSON it reads (`GET /dashboard/state`) and
`metal-serve status`, which prints the same JSON in a terminal (docs/dashboard.md)."""

# The JSON's name and version: fields may be added under it, never renamed or removed.
SCHEMA = "metal-serve.dashboard/1"
