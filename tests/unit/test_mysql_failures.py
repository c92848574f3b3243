"""``raise_query_error``: a failed query or connection of a MariaDB/MySQL source is raised as the runtime's error,
chained to the driver's; an error that is already cdcd's, or no database error at all, is raised as it is and
never becomes its own cause."""

from __future__ import annotations

import pymysql
import pytest

from cdcd.errors import SourceFatal, SourceUnavailable
from cdcd.sources.mysql.failures import raise_query_error


def raised(exc: BaseException) -> BaseException:
    with pytest.raises(BaseException) as caught:
        try:
            raise exc
        except BaseException as handled:
            raise_query_error(handled, "connecting to db:3306")
    return caught.value


def test_a_lost_connection_is_unavailable_and_chained_to_the_drivers_error() -> None:
    driver = pymysql.err.OperationalError(2013, "Lost connection to server during query")
    err = raised(driver)
    assert isinstance(err, SourceUnavailable) and err.__cause__ is driver
    assert "connecting to db:3306" in str(err) and "2013" in str(err)


def test_cdcds_own_error_and_other_errors_are_raised_as_they_are() -> None:
    ours = SourceFatal("the binlog was purged")
    assert raised(ours) is ours and ours.__cause__ is None
    other = KeyError("x")
    assert raised(other) is other and other.__cause__ is None
