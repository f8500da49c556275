"""Optional integrations stay optional: the core and the torch integration never import Ray, JAX or TensorFlow."""

import subprocess
import sys


def test_the_core_does_not_import_ray():
    code = "import sys, gradwire, gradwire.torch; assert 'ray' not in sys.modules, 'gradwire imported ray'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_core_and_the_torch_integration_do_not_import_jax_or_tensorflow():
    code = (
        "import sys, gradwire, gradwire.torch; heavy = {'jax', 'optax', 'flax', 'tensorflow', 'keras'}; "
        "assert not heavy & set(sys.modules), 'gradwire imported a heavy framework'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
