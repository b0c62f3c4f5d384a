"""The repository root is the package ``kvtier`` (pyproject.toml: ``package-dir``), and every
folder below it with an ``__init__.py`` is one of its sub-packages. Only this file, the
tests, scripts, docs and deployment files stay out of the distribution."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "scripts", "scripts.*", "docs", "docs.*", "docker", "docker.*"]


class BuildPy(build_py):
    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("kvtier", "setup")]  # this file


setup(
    packages=["kvtier", *(f"kvtier.{p}" for p in find_packages(".", exclude=NOT_SHIPPED))],
    cmdclass={"build_py": BuildPy},
)
