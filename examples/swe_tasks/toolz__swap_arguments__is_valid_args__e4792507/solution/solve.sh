#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/_signatures.py b/toolz/_signatures.py
--- a/toolz/_signatures.py
+++ b/toolz/_signatures.py
@@ -692,7 +692,7 @@
     if func not in signatures:
         return None
     sigs = signatures[func]
-    return any(check_valid(sig, args, kwargs) for sig in sigs)
+    return any(check_valid(args, sig, kwargs) for sig in sigs)
 
 
 def check_partial(sig, args, kwargs):
SLIME_ENV_SWE_PATCH
