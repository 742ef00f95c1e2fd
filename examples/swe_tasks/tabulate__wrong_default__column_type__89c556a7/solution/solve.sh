#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -1296,7 +1296,7 @@
     return invtypes[moregeneric]
 
 
-def _column_type(strings, has_invisible=True, numparse=True):
+def _column_type(strings, has_invisible=False, numparse=True):
     """The least generic type all column values are convertible to.
 
     >>> _column_type([True, False]) is bool
SLIME_ENV_SWE_PATCH
