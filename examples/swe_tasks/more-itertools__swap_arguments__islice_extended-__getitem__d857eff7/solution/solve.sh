#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/more_itertools/more.py b/more_itertools/more.py
--- a/more_itertools/more.py
+++ b/more_itertools/more.py
@@ -2714,7 +2714,7 @@
 
     def __getitem__(self, key):
         if isinstance(key, slice):
-            return islice_extended(_islice_helper(self._iterator, key))
+            return islice_extended(_islice_helper(key, self._iterator))
 
         raise TypeError('islice_extended.__getitem__ argument must be a slice')
 
SLIME_ENV_SWE_PATCH
