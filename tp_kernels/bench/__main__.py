"""``python -m tp_kernels.bench``: see :mod:`tp_kernels.bench`."""

from tp_kernels.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
