#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/src/cachetools/_descriptor.py b/src/cachetools/_descriptor.py
--- a/src/cachetools/_descriptor.py
+++ b/src/cachetools/_descriptor.py
@@ -51,14 +51,6 @@
             # Replace the descriptor instance with the wrapper in the instance
             # dict.  In case of a race condition where another thread already
             # replaced the descriptor, prefer the initial wrapper.
-            wrapper = self.__wrapper(obj, self)
-            try:
-                wrapper = obj.__dict__.setdefault(attrname, wrapper)
-            except (AttributeError, TypeError) as e:
-                self.__instance_dict_error(obj, e)
-        else:
-            # A super() lookup must neither reuse the override's wrapper
-            # nor replace it, so preserve state separately for each descriptor.
             try:
                 wrappers = obj.__dict__.setdefault("__cachetools_cachedmethods", {})
             except (AttributeError, TypeError) as e:
@@ -67,6 +59,14 @@
             if wrapper is None:
                 wrapper = self.__wrapper(obj, self)
                 wrapper = wrappers.setdefault(self, wrapper)
+        else:
+            # A super() lookup must neither reuse the override's wrapper
+            # nor replace it, so preserve state separately for each descriptor.
+            wrapper = self.__wrapper(obj, self)
+            try:
+                wrapper = obj.__dict__.setdefault(attrname, wrapper)
+            except (AttributeError, TypeError) as e:
+                self.__instance_dict_error(obj, e)
         return wrapper
 
     def __reduce__(self):
SLIME_ENV_SWE_PATCH
