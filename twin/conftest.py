"""What every twin test gets: whatever it did to a twin that its module shares, and however it ended, the
next test finds that twin as the module made it (its server running, no Lambda fault left armed); and a
request of a function that its role in infra/template.yaml does not allow fails the test that caused it,
unless the test took it as expected (Twin.denials(take=True))."""
import pytest

from twin import Twin


@pytest.fixture(autouse=True)
def twin_restored_after_each_test(request):
    yield
    for value in request.node.funcargs.values():
        if isinstance(value, Twin):
            value.restore()
            value.assert_no_denial()
