#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -1432,7 +1432,7 @@
     """Add a left-most index column."""
     if index is None or index is False:
         return rows
-    if isinstance(index, Sized) and len(index) != len(rows):
+    if isinstance(index, Sized) and len(index) == len(rows):
         raise ValueError(
             "index must be as long as the number of data rows: "
             + f"len(index)={len(index)} len(rows)={len(rows)}"
SLIME_ENV_SWE_PATCH
