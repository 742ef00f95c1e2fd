#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -547,7 +547,7 @@
 
     def __eq__(self, other):
         if isinstance(other, Compose):
-            return other.first == self.first and other.funcs == self.funcs
+            return other.first == self.first and other.funcs != self.funcs
         return NotImplemented
 
     def __ne__(self, other):
SLIME_ENV_SWE_PATCH
