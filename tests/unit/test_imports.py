"""Optional integrations stay optional: the core and the torch integration never import Ray."""

import subprocess
import sys


def test_the_core_does_not_import_ray():
    code = "import sys, gradwire, gradwire.torch; assert 'ray' not in sys.modules, 'gradwire imported ray'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
