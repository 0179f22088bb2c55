"""The C extension of a source build (pyproject.toml): its flags from pkg-config's smartgen.pc."""

import shlex
import subprocess

from setuptools import Extension, setup


def pkg_config(*args: str) -> list:
    try:
        out = subprocess.run(["pkg-config", *args, "smartgen"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit("smartgen: pkg-config cannot find smartgen.pc: install libsmartgen-dev (or smartgen-devel), "
                         f"or set PKG_CONFIG_PATH to the folder that holds it ({e})")
    return shlex.split(out)


setup(ext_modules=[Extension("smartgen._native", ["smartgen/_native.c"],
                             extra_compile_args=pkg_config("--cflags"), extra_link_args=pkg_config("--libs"))])
