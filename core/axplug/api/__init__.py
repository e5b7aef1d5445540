"""The plugin API floor."""
