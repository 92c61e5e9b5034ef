"""`python -m titan.kernels`: compile the native kernels now (make setup does) and print which path runs."""

import logging

from titan.kernels.build import backend_name, native, native_error

logging.basicConfig(level=logging.INFO, format="%(message)s")
print(f"titan kernels: {backend_name()}" + (f" ({native_error()})" if native() is None else ""))
