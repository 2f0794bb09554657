"""The server distribution's package discovery: services/ is the import root ``yieldloop_server``.

pyproject.toml cannot rename a discovered folder; this maps it, and every package under services/ is
found rather than listed (a new ``services/<x>/`` package cannot be left out of the wheel).
"""

from setuptools import find_packages, setup

setup(
    package_dir={"yieldloop_server": "services"},
    packages=["yieldloop_server", *(f"yieldloop_server.{name}" for name in find_packages("services"))],
)
