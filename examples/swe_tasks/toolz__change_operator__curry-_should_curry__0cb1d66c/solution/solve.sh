#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/functoolz.py b/toolz/functoolz.py
--- a/toolz/functoolz.py
+++ b/toolz/functoolz.py
@@ -310,7 +310,7 @@
 
     def _should_curry(self, args, kwargs, exc=None):
         func = self.func
-        args = self.args + args
+        args = self.args - args
         if self.keywords:
             kwargs = dict(self.keywords, **kwargs)
         if self._sigspec is None:
SLIME_ENV_SWE_PATCH
