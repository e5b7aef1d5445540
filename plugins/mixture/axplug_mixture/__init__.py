"""axplug-mixture: the `mixture` input, a weighted mixture of prepared data directories."""

from axplug_mixture.input import BLOCK, MixtureInput, quotas

__all__ = ["MixtureInput", "BLOCK", "quotas"]
