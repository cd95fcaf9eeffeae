"""Models and simulated worlds shared by dtcompile's tests, benchmarks and demo."""
