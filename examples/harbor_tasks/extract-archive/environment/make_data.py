import gzip
import io
import os
import tarfile
os.makedirs('/app/incoming', exist_ok=True)
with tarfile.open('/app/incoming/data.tar.gz', 'w:gz') as t:
    for name, text in [('export/a.csv', 'x,y\n1,2\n'), ('export/b.csv', 'x,y\n3,4\n')]:
        data = text.encode()
        info = tarfile.TarInfo(name)
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
open('/app/incoming/readme.txt.gz', 'wb').write(gzip.compress(b'read me\n'))
