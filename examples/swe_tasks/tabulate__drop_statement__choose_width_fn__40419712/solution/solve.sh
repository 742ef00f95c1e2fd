#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -1154,7 +1154,7 @@
 def _choose_width_fn(has_invisible, enable_widechars, is_multiline):
     """Return a function to calculate visible cell width."""
     if has_invisible:
-        line_width_fn = _visible_width
+        pass
     elif enable_widechars:  # optional wide-character support if available
         line_width_fn = wcwidth.wcswidth
     else:
SLIME_ENV_SWE_PATCH
