"""`python -m axplug_attention`: which attention kernel dispatch picks on this machine."""

from axplug_attention.dispatch import describe_kernels

if __name__ == "__main__":
    print("\n".join(describe_kernels()))
