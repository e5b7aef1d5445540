"""MLflow summary writer for axplug (`--writer mlflow`)."""

from axplug_mlflow.writer import MlflowWriter

__all__ = ["MlflowWriter"]
