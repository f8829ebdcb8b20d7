"""Every storage test runs on local disk and on the S3 server (tests/support)."""

import pytest


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "storage")
    return request.getfixturevalue("s3_bucket") + "/root"
