"""cdcd benchmarks: cdcd side by side with the raw tools, in one run, reported as ratios."""
