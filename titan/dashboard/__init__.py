"""The live dashboard shared by `titan serve` and `titan router`: `GET /dashboard` (one static page, uPlot
vendored under static/ with its licence) polling `GET /debug/dashboard` (JSON, protected like /debug/*)."""
