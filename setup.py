"""The repository root is the package ``kvtier`` (pyproject.toml: ``package-dir``), and every
folder below it with an ``__init__.py`` is one of its sub-packages. Only this file, the
tests, scripts, docs and deployment files stay out of the distribution."""

from setuptools import Extension, find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "scripts", "scripts.*", "docs", "docs.*", "docker", "docker.*"]


class BuildPy(build_py):
    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("kvtier", "setup")]  # this file


# vLLM KV event decoding in C (index/ingest/vllm_wire.py): optional, so a machine without a
# C compiler still installs (msgspec then decodes every event, slower)
NATIVE = [
    Extension(
        "kvtier.index.ingest._ingest_c",
        ["index/ingest/_ingest_c.c"],
        extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        optional=True,
    )
]

setup(
    packages=["kvtier", *(f"kvtier.{p}" for p in find_packages(".", exclude=NOT_SHIPPED))],
    cmdclass={"build_py": BuildPy},
    ext_modules=NATIVE,
)
