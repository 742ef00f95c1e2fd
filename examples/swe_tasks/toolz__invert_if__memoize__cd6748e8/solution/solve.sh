#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -444,13 +444,13 @@
                 return args[0]
         elif may_have_kwargs:
             def key(args, kwargs):
+                return args
+        else:
+            def key(args, kwargs):
                 return (
                     args or None,
                     frozenset(kwargs.items()) if kwargs else None,
                 )
-        else:
-            def key(args, kwargs):
-                return args
 
     def memof(*args, **kwargs):
         k = key(args, kwargs)
SLIME_ENV_SWE_PATCH
