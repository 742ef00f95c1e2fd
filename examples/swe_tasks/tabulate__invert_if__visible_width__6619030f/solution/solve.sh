#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/tabulate/__init__.py b/tabulate/__init__.py
--- a/tabulate/__init__.py
+++ b/tabulate/__init__.py
@@ -1134,9 +1134,9 @@
     else:
         len_fn = len
     if isinstance(s, (str, bytes)):
+        return len_fn(str(s))
+    else:
         return len_fn(_strip_ansi(s))
-    else:
-        return len_fn(str(s))
 
 
 def _is_multiline(s):
SLIME_ENV_SWE_PATCH
