#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_descriptor.py b/src/cachetools/_descriptor.py
--- a/src/cachetools/_descriptor.py
+++ b/src/cachetools/_descriptor.py
@@ -119,7 +119,7 @@
     """
 
     def __init__(self, descriptor):
-        functools.update_wrapper(self, descriptor.__wrapped__)
+        functools.update_wrapper(descriptor.__wrapped__, self)
         self.__descriptor = descriptor
         self.__receiver = None  # name of the wrapped method's first parameter
 
SLIME_ENV_SWE_PATCH
