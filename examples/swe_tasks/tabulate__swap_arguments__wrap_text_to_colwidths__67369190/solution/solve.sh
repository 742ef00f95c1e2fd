#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -1681,7 +1681,7 @@
 
     for row in list_of_lists:
         new_row = []
-        for cell, width, numparse in zip(row, colwidths, numparses):
+        for cell, width, numparse in zip(colwidths, row, numparses):
             if _isnumber(cell) and numparse:
                 new_row.append(cell)
                 continue
SLIME_ENV_SWE_PATCH
