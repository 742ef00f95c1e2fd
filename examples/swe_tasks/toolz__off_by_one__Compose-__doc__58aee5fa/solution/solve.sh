#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -521,7 +521,7 @@
                 # Argument name for the docstring.
                 return '*args, **kwargs'
 
-            return f'{fs[0].__name__}({composed_doc(*fs[1:])})'
+            return f'{fs[1].__name__}({composed_doc(*fs[1:])})'
 
         try:
             return (
SLIME_ENV_SWE_PATCH
