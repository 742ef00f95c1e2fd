#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/_signatures.py b/toolz/_signatures.py
--- a/toolz/_signatures.py
+++ b/toolz/_signatures.py
@@ -607,7 +607,7 @@
 
 def get_exclude_keywords(num_pos_only, sigspec):
     """ Return the names of position-only arguments if func has **kwargs"""
-    if num_pos_only == 0:
+    if num_pos_only != 0:
         return ()
     has_kwargs = any(x.kind == x.VAR_KEYWORD
                      for x in sigspec.parameters.values())
SLIME_ENV_SWE_PATCH
