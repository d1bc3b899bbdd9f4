"""What every twin test gets: whatever it did to a twin that its module shares, and however it ended, the
next test finds that twin as the module made it (its server running, no Lambda fault left armed)."""
import pytest

from twin import Twin


@pytest.fixture(autouse=True)
def twin_restored_after_each_test(request):
    yield
    for value in request.node.funcargs.values():
        if isinstance(value, Twin):
            value.restore()
