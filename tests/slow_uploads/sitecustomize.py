"""Put first on a child's PYTHONPATH: its uploads of objects whose key holds ``SLOW_UPLOADS`` are logged to
``SLOW_UPLOADS_LOG`` and take 30 s more, so that a test can kill the child in the middle of one."""

import os

if os.environ.get("SLOW_UPLOADS"):
    import asyncio

    import s3fs.core

    _put_file = s3fs.core.S3FileSystem._put_file

    async def _slow_put_file(self, lpath, rpath, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if os.environ["SLOW_UPLOADS"] in str(rpath):
            with open(os.environ["SLOW_UPLOADS_LOG"], "a") as log:
                log.write(f"{rpath}\n")
            await asyncio.sleep(30)
        return await _put_file(self, lpath, rpath, *args, **kwargs)

    s3fs.core.S3FileSystem._put_file = _slow_put_file
