"""``parse_uri``: which store a checkpoint URI names, and the URIs it refuses. No servers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.launcher import canonical_uri
from agent.storage import MAX_PREFIX_BYTES, open_storage, parse_uri


@pytest.mark.parametrize(
    ("uri", "parsed"),
    [
        ("s3://b/run/1", ("s3", "b", "run/1")),
        ("gs://bkt/run/", ("gs", "bkt", "run")),
        ("file:///data/ckpt", ("file", "", "/data/ckpt")),
        ("file://localhost/data/ckpt", ("file", "", "/data/ckpt")),
        ("/data/ckpt", ("file", "", "/data/ckpt")),
        ("ckpt/run-1", ("file", "", "ckpt/run-1")),
        ("gs://bkt//run", ("gs", "bkt", "run")),
        ("s3://b/jobs/run/", ("s3", "b", "jobs/run")),
        ("file:/data/ckpt", ("file", "", "/data/ckpt")),
    ],
)
def test_a_uri_names_its_scheme_bucket_and_path(uri: str, parsed: tuple[str, str, str]) -> None:
    assert parse_uri(uri) == parsed


@pytest.mark.parametrize(
    "uri",
    [
        "s3://b/run#1",
        "s3://b/run?v=1",
        "s3://b#1/run",
        "gs://b/run#1",
        "gs://b/run?versions=true",
        "file:///data/ckpt#1",
        "file:///data/ckpt?x",
        "/data/ckpt#1",
        "ckpt?",
    ],
)
def test_a_hash_or_question_mark_is_refused_not_dropped(uri: str) -> None:
    """A URL parser reads them as a fragment or a query and drops them: ``s3://b/run#1`` would
    silently be ``s3://b/run``, another run's prefix."""
    with pytest.raises(ValueError, match=r"'#' and '\?' are not supported in checkpoint URIs") as caught:
        parse_uri(uri)
    assert repr(uri) in str(caught.value)
    with pytest.raises(ValueError, match="not supported in checkpoint URIs"):
        open_storage(uri)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI@bucket/run",
        "s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY@bucket/run",  # a '/' in the secret
        "gs://user:wJalrXUtnFEMI@bucket/run",
        "s3://wJalrXUtnFEMI@bucket/run#1",
        # Schemes refused anyway, by a message that repeated the URI (an InvalidCheckpointURI Event).
        "https://minio:wJalrXUtnFEMI@minio.local:9000/bucket/run",
        "file://user:wJalrXUtnFEMI@host/ckpt",
        "ftp://wJalrXUtnFEMI@host/ckpt?x",
    ],
)
def test_credentials_in_a_uri_are_refused_without_repeating_them(uri: str) -> None:
    """No bucket name holds ':' or '@'. Taken as a bucket, the secret would be in every log line,
    Event and status that names the URI."""
    with pytest.raises(ValueError, match="takes no credentials") as caught:
        parse_uri(uri)
    assert "wJalrXUtnFEMI" not in str(caught.value)
    with pytest.raises(ValueError, match="takes no credentials"):
        open_storage(uri)


@pytest.mark.parametrize("uri", ["~/ckpt", "~", "~other/ckpt"])
def test_a_tilde_path_is_refused_not_made_a_folder_named_tilde(uri: str) -> None:
    # `spotjob run --checkpoint-uri=~/ckpt` (the shell leaves that ~ alone) used to write the
    # checkpoints to ./~/ckpt under the working directory.
    with pytest.raises(ValueError, match="'~' is not expanded in a checkpoint URI; write the full path"):
        parse_uri(uri)
    assert parse_uri(f"./{uri}") == ("file", "", f"./{uri}")


@pytest.mark.parametrize("uri", ["s3://bkt/jobs//run", "gs://bkt/jobs//run/", "S3://bkt/jobs///run"])
def test_a_doubled_slash_inside_a_prefix_is_refused_naming_the_spelling_and_where_old_checkpoints_are(
    uri: str,
) -> None:
    """``canonical_uri`` (the agent) and ``normalise_uri`` (the Checkpointer) take ``jobs//run`` for
    ``jobs/run``, while spotjob wrote such a URI's checkpoints under the keys ``jobs//run/``: writing
    to either silently would leave the other out of sight (a flush where the controller never
    looks, or a resume that misses the checkpoints already there)."""
    scheme = uri.split(":", 1)[0].lower()
    with pytest.raises(ValueError, match=r"has an empty folder \('//'\) in its path") as caught:
        parse_uri(uri)
    message = str(caught.value)
    assert f"write {scheme}://bkt/jobs/run." in message
    assert "'jobs/run/'" in message and "jobs//run/" in message.replace("///", "//")
    with pytest.raises(ValueError, match="empty folder"):
        open_storage(uri)


@pytest.mark.parametrize(
    ("uri", "segment", "tidy", "old_keys"),
    [
        ("gs://bkt/a/../run", "..", "gs://bkt/run", "'a/../run/'"),
        ("s3://bkt/a/../run", "..", "s3://bkt/run", "'a/../run/'"),
        ("s3://bkt/jobs/./run/", ".", "s3://bkt/jobs/run", "'jobs/./run/'"),
        ("gs://bkt/./run", ".", "gs://bkt/run", "'./run/'"),
        ("GS://bkt/jobs/run/..", "..", "gs://bkt/jobs", "'jobs/run/../'"),
        ("s3://bkt/../run", "..", "s3://bkt/run", "'../run/'"),
    ],
)
def test_a_dot_segment_in_a_bucket_prefix_is_refused_naming_it_and_what_to_write(
    uri: str, segment: str, tidy: str, old_keys: str
) -> None:
    """S3 and GCS keep '.' and '..' as literal names, while fake-gcs-server wrote and read
    gs://bkt/a/../run at 'run/' but listed 'a/../run/': a save's checkpoints were never found by the
    restore after it. Failed before the fix: the URI was taken."""
    with pytest.raises(ValueError, match=f"has a '{re.escape(segment)}' segment in its path") as caught:
        parse_uri(uri)
    message = str(caught.value)
    assert f"write {tidy} " in message and old_keys in message, message
    with pytest.raises(ValueError, match="segment in its path"):
        open_storage(uri)


@pytest.mark.parametrize(
    ("bucket", "rule"),
    [
        ("-b", "must start and end with a letter or a digit"),
        ("..", "must start and end with a letter or a digit"),
        ("bkt_", "must start and end with a letter or a digit"),
        ("b", "is 1 character long: GCS takes 3 to 63"),
        ("b" * 64, "is 64 characters long: GCS takes 3 to 63"),
        ("a." + "b" * 64, "has a dot-separated part 64 characters long: GCS takes at most 63"),
        (".".join(["b" * 60] * 4), "is 243 characters long: GCS takes at most 222 (with dots)"),
        ("My-Bucket", "has upper-case letters: GCS bucket names are lower case; write gs://my-bucket/run"),
        ("b\u00fccket", "has 'ü': a GCS bucket name is lowercase letters, digits, '-', '_' and '.'"),
        ("b+kt", "has '+': a GCS bucket name is lowercase letters, digits, '-', '_' and '.'"),
        ("192.168.5.4", "is in dotted-decimal form (as an IP address is), which GCS refuses for a bucket name"),
        ("256.1.1.1", "is in dotted-decimal form (as an IP address is), which GCS refuses for a bucket name"),
        ("goog-ckpt", "begins with 'goog', which GCS keeps for itself"),
        ("my-google-ckpt", "contains 'google', which GCS keeps for itself"),
    ],
)
def test_a_gcs_bucket_name_gcs_refuses_is_refused_naming_the_uri_the_bucket_and_the_rule(
    bucket: str, rule: str
) -> None:
    """Before the fix the client's own check surfaced later, bare ("Bucket names must start and end
    with a number or letter."), from opening the store: ``spotjob run`` made the run and failed it
    (InvalidCheckpointURI), and a name the client lets through was a 404 read as a missing bucket.
    Only the rule broken is said: a summary of every rule after it contradicted the reason for
    'goog', 'google', dotted-decimal and dotted-length refusals."""
    uri = f"gs://{bucket}/run"
    with pytest.raises(ValueError) as caught:
        parse_uri(uri)
    message = str(caught.value)
    fix = "" if "; write " in rule else "; correct the bucket in the checkpoint URI (gs://BUCKET/prefix)"
    assert message == f"{uri!r}: the bucket name {bucket!r} {rule}{fix}", message
    with pytest.raises(ValueError, match="the bucket name"):
        open_storage(uri)


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        ("gs://b/a/../run", "the bucket name 'b' is 1 character long: GCS takes 3 to 63"),
        ("gs://b/jobs//run", "the bucket name 'b' is 1 character long: GCS takes 3 to 63"),
        ("gs://-b/./run", "the bucket name '-b' must start and end with a letter or a digit"),
        (
            "gs://Ab/run",
            "the bucket name 'Ab' has upper-case letters (GCS bucket names are lower case) and is 2 characters "
            "long: GCS takes 3 to 63",
        ),
        (
            "gs://GOOG-x/run",
            "the bucket name 'GOOG-x' has upper-case letters (GCS bucket names are lower case) and begins with "
            "'goog', which GCS keeps for itself",
        ),
        ("gs://My-Bucket/a//b/../run", "the bucket name 'My-Bucket' has upper-case letters"),
    ],
)
def test_a_gcs_bucket_name_is_checked_before_the_prefix_so_no_advice_is_refused_in_turn(uri: str, said: str) -> None:
    """The '//' and '.'/'..' checks ran first and told ``gs://b/a/../run`` to write ``gs://b/run``,
    and upper case was told the lower-case name (``gs://ab/run``, ``gs://goog-x/run``): each
    refused in turn for its bucket. The bucket's rule is named first; a URI is advised only where
    it is taken."""
    with pytest.raises(ValueError) as caught:
        parse_uri(uri)
    message = str(caught.value)
    assert message.startswith(f"{uri!r}: {said}"), message
    for advised in re.findall(r"write (gs://\S+?)[.;:)]?(?:\s|$)", message):
        assert parse_uri(advised)[0] == "gs", advised
    if "My-Bucket" in uri:
        assert "write gs://my-bucket/a/run" in message, message
    else:
        assert "write gs://" not in message, message


@pytest.mark.parametrize(
    "bucket", ["bkt", "b" * 63, "my_ckpt-2", "a.b.c", ".".join(["b" * 63] * 3) + ".bb", "1.2.3.4.5", "9bkt"]
)
def test_a_gcs_bucket_name_gcs_takes_is_taken(bucket: str) -> None:
    assert parse_uri(f"gs://{bucket}/run") == ("gs", bucket, "run")


@pytest.mark.parametrize("name", ["run.1", "...", "..run", "run.."])
def test_dots_inside_a_name_are_a_name_like_any_other(name: str) -> None:
    assert parse_uri(f"s3://b/jobs/{name}/x") == ("s3", "b", f"jobs/{name}/x")


def test_a_folder_path_with_dot_segments_is_resolved_once_for_writes_listings_and_its_uri(tmp_path: Path) -> None:
    """A filesystem resolves them itself; the folder store resolves them once, when opened, so what
    it writes, what it lists and the URI it reports are one folder (``canonical_uri`` agrees)."""
    (tmp_path / "a").mkdir()
    store = open_storage(f"{tmp_path}/a/../run/./x")
    try:
        store.put_bytes("step-1/MANIFEST.json", b"{}")
        assert store.uri == f"file://{tmp_path}/run/x" == canonical_uri(f"{tmp_path}/a/../run/./x")
        assert (tmp_path / "run" / "x" / "step-1" / "MANIFEST.json").read_bytes() == b"{}"
        assert [o.key for o in store.list("")] == ["step-1/MANIFEST.json"]
    finally:
        store.close()


@pytest.mark.parametrize("uri", ["file:relative", "file:ckpt/run", "file:"])
def test_a_file_uri_without_an_absolute_path_is_refused_naming_what_to_write(uri: str) -> None:
    with pytest.raises(ValueError, match=r"file URIs take an absolute path, e\.g\. file:///data/ckpt") as caught:
        parse_uri(uri)
    assert repr(uri) in str(caught.value) and "plain path" in str(caught.value)


@pytest.mark.parametrize("uri", ["s3://b/caf\udce9/run", "gs://bkt/run-\udcff"])
def test_a_uri_that_is_not_utf8_is_refused_naming_it(uri: str) -> None:
    """Undecodable bytes on the command line reach Python as lone surrogates; boto3 and
    google-cloud-storage failed on them at the first write with a bare UnicodeEncodeError."""
    with pytest.raises(ValueError, match="is not valid UTF-8") as caught:
        parse_uri(uri)
    assert repr(uri) in str(caught.value)


def test_a_prefix_too_long_for_s3_and_gcs_names_is_refused_up_front() -> None:
    """S3 keys and GCS object names are at most 1024 bytes; the prefix leaves room for spotjob's own."""
    longest = "é" * (MAX_PREFIX_BYTES // 2) + "a" * (MAX_PREFIX_BYTES % 2)
    assert parse_uri(f"s3://b/{longest}") == ("s3", "b", longest)
    for uri in (f"s3://b/{longest}x", f"gs://bkt/{'é' * 1000}"):
        with pytest.raises(ValueError, match=f"may have at most {MAX_PREFIX_BYTES}; choose a shorter one"):
            parse_uri(uri)
    assert parse_uri("/" + "d/" * 600) == ("file", "", "/" + "d/" * 600)  # a folder: the filesystem's limits


@pytest.mark.parametrize(
    "uri", ["s3://b/ru\nn", "gs://b/jobs/ru\tn", "s3://b/run\r", "file:///data/ck\npt", "/data/ck\tpt", "s3://b/x\x01"]
)
def test_a_control_character_is_refused_not_dropped(uri: str) -> None:
    """urlparse drops tabs and newlines: ``s3://b/ru\\nn`` was silently ``s3://b/run``, another
    run's prefix, in the store and in every comparison of two URIs."""
    with pytest.raises(ValueError, match=r"control characters .* are not supported in checkpoint URIs") as caught:
        parse_uri(uri)
    assert repr(uri) in str(caught.value)
    with pytest.raises(ValueError, match="control characters"):
        open_storage(uri)


@pytest.mark.parametrize("uri", [" /data/ckpt", "/data/ckpt ", "s3://b/run ", " gs://b/run", "file:///data/ckpt\u00a0"])
def test_white_space_around_a_uri_is_refused_naming_the_tidy_spelling(uri: str) -> None:
    """`` /data/ckpt`` was a folder named ``' '`` under the working directory, ``s3://b/run ``
    another prefix than ``s3://b/run``: a quoting slip that resumes from nothing."""
    with pytest.raises(ValueError, match="begins or ends with white space") as caught:
        parse_uri(uri)
    assert repr(uri.strip()) in str(caught.value)
    with pytest.raises(ValueError, match="white space"):
        open_storage(uri)


@pytest.mark.parametrize("uri", ['"s3://b/run"', "'gs://b/run'", '"/data/ckpt"', "s3://b/run'", '"file:///data/ckpt'])
def test_quotes_around_a_uri_are_refused_naming_the_unquoted_spelling(uri: str) -> None:
    """A value quoted twice (YAML around a Secret's value, an env file's quotes kept by docker's
    --env-file): ``"s3://b/run"`` has no scheme, so it was a folder named ``"s3:`` under the
    working directory, on local disk, without a word."""
    with pytest.raises(ValueError, match="begins or ends with a quote") as caught:
        parse_uri(uri)
    assert repr(uri.strip("'\"")) in str(caught.value)
    with pytest.raises(ValueError, match="quote"):
        open_storage(uri)
