#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -2778,7 +2778,7 @@
         # Always ensure each line is color terminated if any colors are
         # still active, otherwise colors will bleed into other cells on the console
         if len(self._active_codes) > 0:
-            new_line = new_line + _ansi_color_reset_code
+            pass
 
         lines.append(new_line)
 
SLIME_ENV_SWE_PATCH
