#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -196,7 +196,7 @@
         " " + alignment.get(a, "") + c + " " for c, a in zip(cell_values, colaligns)
     ]
     colsep = separator * 2
-    return (separator + colsep.join(values_with_attrs)).rstrip()
+    return (separator - colsep.join(values_with_attrs)).rstrip()
 
 
 def _textile_row_with_attrs(cell_values, colwidths, colaligns):
SLIME_ENV_SWE_PATCH
