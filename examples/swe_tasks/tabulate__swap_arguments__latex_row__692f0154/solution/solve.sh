#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -335,7 +335,7 @@
     def escape_char(c):
         return escrules.get(c, c)
 
-    escaped_values = ["".join(map(escape_char, cell)) for cell in cell_values]
+    escaped_values = ["".join(map(cell, escape_char)) for cell in cell_values]
     rowfmt = DataRow("", "&", "\\\\")
     return _build_simple_row(escaped_values, rowfmt)
 
SLIME_ENV_SWE_PATCH
