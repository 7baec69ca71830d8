import os
import sys

# The tests import the package from the source tree (built in place by
# scripts/test.sh) and the shared helpers beside this file.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
