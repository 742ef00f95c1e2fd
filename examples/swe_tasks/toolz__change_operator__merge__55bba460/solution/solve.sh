#!/bin/bash
# The oracle: this task's bug, reversed.
set -e
cd /repo
git apply -R --whitespace=nowarn <<'SLIME_ENV_SWE_PATCH'
diff --git a/toolz/dicttoolz.py b/toolz/dicttoolz.py
--- a/toolz/dicttoolz.py
+++ b/toolz/dicttoolz.py
@@ -30,7 +30,7 @@
     See Also:
         merge_with
     """
-    if len(dicts) == 1 and not isinstance(dicts[0], Mapping):
+    if len(dicts) == 1 or not isinstance(dicts[0], Mapping):
         dicts = dicts[0]
     factory = _get_factory(merge, kwargs)
 
SLIME_ENV_SWE_PATCH
