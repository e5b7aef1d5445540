"""axplug-metrics: `axplug metrics RUN_DIR`, a run's last records and plots of its metrics (the
terminal with plotext, a PNG with matplotlib), read from the run's own metrics.jsonl."""

__version__ = "0.1.0"
