"""Builds tf_sfctr: the custom-op library from ops/ and the Python packages.

All compiler and linker flags come from the installed TensorFlow
(``tf.sysconfig``), so the library matches its C++ ABI. TensorFlow must be
installed first and the build run without isolation::

    pip install -c constraints.txt tensorflow-cpu==2.16.2
    pip install --no-build-isolation -e .
"""

import glob
import json
import os

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

SUPPORTED_TF = ("2.16.",)  # keep in sync with constraints.txt
HERE = os.path.dirname(os.path.abspath(__file__))
OP_SOURCES = sorted(
    glob.glob("ops/*.cc") + glob.glob("ops/kernels/*.cc") + glob.glob("ops/core/*.cc")
)


class BuildTfOps(build_ext):
    """Compiles the op library with TensorFlow's own flags."""

    _in_place = False

    def run(self):
        self._in_place = bool(self.inplace)  # `setup.py build_ext --inplace`
        super().run()

    def build_extensions(self):
        try:
            import tensorflow as tf
        except ImportError as err:  # pragma: no cover - build-time message
            raise SystemExit(
                "tf_sfctr builds against the installed TensorFlow, and this build "
                "cannot import one: pip builds in an isolated environment unless "
                "given --no-build-isolation. Install TensorFlow first (pip install "
                "-c constraints.txt tensorflow-cpu==2.16.2), then build with "
                "`pip install --no-build-isolation .`."
            ) from err
        version = tf.__version__
        if not version.startswith(SUPPORTED_TF):
            raise SystemExit(
                f"tf_sfctr supports TensorFlow {', '.join(v + 'x' for v in SUPPORTED_TF)}; "
                f"found {version}. Install a supported version (see constraints.txt)."
            )
        compile_flags = tf.sysconfig.get_compile_flags()
        link_flags = tf.sysconfig.get_link_flags()
        # -ffp-contract=off: no fused multiply-adds the source does not write.
        # The kernels promise TF's bits (Adagrad, FTRL) and a plain loop's
        # (segment sums); GCC fuses a * b + c where FMA exists (aarch64, or
        # -march=native on x86-64), which changed 1008 of 2016 sums of
        # squares in a review.
        for ext in self.extensions:
            ext.extra_compile_args = ["-std=c++17", "-O3", "-fPIC", "-Wno-sign-compare",
                                      "-ffp-contract=off"] + [
                f for f in compile_flags if not f.startswith("-std=")
            ]
            ext.extra_link_args = list(link_flags)
        self.parallel = self.parallel or os.cpu_count() or 1
        # A library left in the build directory by a build under another
        # TensorFlow is compiled again: setuptools would reuse it (its
        # sources are older), and the stamp below would then name a version
        # it was not built for.
        built_dir = os.path.dirname(self.get_ext_fullpath("tf_sfctr._sfctr_ops"))
        try:
            with open(os.path.join(built_dir, "_build_info.json")) as f:
                built_for = json.load(f).get("tensorflow_version")
        except (OSError, ValueError, AttributeError):
            built_for = None
        if built_for != version:
            self.force = True
        super().build_extensions()
        # Stamp the TensorFlow version next to the library; the loader refuses
        # to load it under another version.
        # Written next to the built library, and into the source package
        # only by an in-place (editable) build, which loads it from there: a
        # plain install from the checkout into another environment must not
        # re-label the checkout's own library.
        # (setuptools clears `inplace` while it builds; `editable_mode` stays.)
        out_dirs = {
            os.path.dirname(self.get_ext_fullpath("tf_sfctr._sfctr_ops")),
            os.path.join(self.build_lib, "tf_sfctr"),
        }
        if getattr(self, "editable_mode", False) or self._in_place:
            out_dirs.add(os.path.join(HERE, "tf_sfctr"))
        for out_dir in out_dirs:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "_build_info.json"), "w") as f:
                json.dump({"tensorflow_version": version}, f)

    def get_ext_filename(self, ext_name):
        # A plain .so name (no Python ABI tag): it is loaded by
        # tf.load_op_library, not imported as a Python module.
        return os.path.join(*ext_name.split(".")) + ".so"


setup(
    name="tf_sfctr",
    version="0.1.0",
    description=(
        "Cached embeddings over an unbounded host hash table for TensorFlow/Keras "
        "CTR models (ScaleFreeCTR-style)."
    ),
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    # The code; the MovieLens copy (tf_sfctr/movielens_data) keeps GroupLens's
    # terms, in its README.txt.
    license="Apache-2.0",
    classifiers=["License :: OSI Approved :: Apache Software License"],
    # TensorFlow 2.16 has wheels for Python 3.9 to 3.12.
    python_requires=">=3.9,<3.13",
    # The MovieLens copy that data.movielens() reads goes into the wheel too
    # (as tf_sfctr/movielens_data/), so it works outside the repository.
    packages=find_packages(include=["tf_sfctr", "tf_sfctr.*"])
    + ["tf_sfctr.keras_layers", "tf_sfctr.movielens_data"],
    package_dir={"tf_sfctr.keras_layers": "keras_layers",
                 "tf_sfctr.movielens_data": "data/movielens-latest-small"},
    package_data={"tf_sfctr": ["_build_info.json"],
                  "tf_sfctr.movielens_data": ["ratings.csv", "movies.csv", "README.txt"]},
    ext_modules=[Extension("tf_sfctr._sfctr_ops", sources=OP_SOURCES, language="c++")],
    cmdclass={"build_ext": BuildTfOps},
    # TensorFlow itself is not listed: users pick tensorflow (GPU) or
    # tensorflow-cpu 2.16.x, and pip cannot express "either of the two".
    # TensorFlow 2.16 takes any Keras 3, and pip picks the newest; the
    # library is tested with 3.5 (constraints.txt).
    install_requires=["numpy<2", "keras>=3.5,<3.6"],
    extras_require={
        # data.parquet: pyarrow is its default engine and checks files for
        # the other engine, tensorflow-io's, which misreads nulls and
        # compressed string columns.
        "data": ["tensorflow-io==0.37.1", 'pyarrow==25.0.1; python_version >= "3.10"',
                 'pyarrow==21.0.0; python_version < "3.10"'],
        "bench": ["tensorflow-recommenders-addons==0.8.1", "setuptools<70"],
    },
    zip_safe=False,
)
