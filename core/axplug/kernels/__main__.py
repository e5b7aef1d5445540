"""`python -m axplug.kernels`: which attention kernel dispatch picks on this machine."""

from axplug.kernels.dispatch import describe_kernels

if __name__ == "__main__":
    print("\n".join(describe_kernels()))
