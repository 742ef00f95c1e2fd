#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -300,6 +300,12 @@
         # three arguments are passed if called in the context of dataline or headerline
         # print the table line and make the aboveline if it is a header
 
+        raise ValueError(
+            "_asciidoc_row() requires two (colwidths, colaligns) "
+            + "or three (cell_values, colwidths, colaligns) arguments) "
+        )
+
+    else:
         cell_values, colwidths, colaligns = args
         data_line = "|" + "|".join(cell_values)
 
@@ -307,12 +313,6 @@
             return make_header_line(True, colwidths, colaligns) + "\n" + data_line
         else:
             return data_line
-
-    else:
-        raise ValueError(
-            "_asciidoc_row() requires two (colwidths, colaligns) "
-            + "or three (cell_values, colwidths, colaligns) arguments) "
-        )
 
 
 LATEX_ESCAPE_RULES = {
SLIME_ENV_SWE_PATCH
