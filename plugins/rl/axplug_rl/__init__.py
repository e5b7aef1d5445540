"""axplug-rl: GRPO-family reinforcement learning on rollouts from the trainer's own Engine."""
