"""Fixtures of the training tests: a few KJV verses, so no test needs Debian's `bible` reader."""

from __future__ import annotations

import pytest

from .distill_volume import build_volume, copy_volume

KJV_SAMPLE = """\
Ge1:1 In the beginning God created the heaven and the earth.
Ge1:2 And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.
Ge1:3 And God said, Let there be light: and there was light.
Ge1:4 And God saw the light, that it was good: and God divided the light from the darkness.
Ge1:5 And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day.
Ge1:6 And God said, Let there be a firmament in the midst of the waters, and let it divide the waters from the waters.
Ge1:7 And God made the firmament, and divided the waters which were under the firmament from the waters which were above the firmament: and it was so.
Ge1:8 And God called the firmament Heaven. And the evening and the morning were the second day.
Ge2:1 Thus the heavens and the earth were finished, and all the host of them.
Ge2:2 And on the seventh day God ended his work which he had made; and he rested on the seventh day from all his work which he had made.
Ge2:3 And God blessed the seventh day, and sanctified it: because that in it he had rested from all his work which God created and made.
Ge2:4 These are the generations of the heavens and of the earth when they were created, in the day that the LORD God made the earth and the heavens,
Ge2:5 And every plant of the field before it was in the earth, and every herb of the field before it grew: for the LORD God had not caused it to rain upon the earth, and there was not a man to till the ground.
Ge2:6 But there went up a mist from the earth, and watered the whole face of the ground.
John1:1 In the beginning was the Word, and the Word was with God, and the Word was God.
John1:2 The same was in the beginning with God.
John1:3 All things were made by him; and without him was not any thing made that was made.
John1:4 In him was life; and the life was the light of men.
John1:5 And the light shineth in darkness; and the darkness comprehended it not.
John1:6 There was a man sent from God, whose name was John.
John1:7 The same came for a witness, to bear witness of the Light, that all men through him might believe.
1Jn1:1 That which was from the beginning, which we have heard, which we have seen with our eyes, which we have looked upon, and our hands have handled, of the Word of life;
1Jn1:2 (For the life was manifested, and we have seen it, and bear witness, and shew unto you that eternal life, which was with the Father, and was manifested unto us;)
1Jn1:3 That which we have seen and heard declare we unto you, that ye also may have fellowship with us: and truly our fellowship is with the Father, and with his Son Jesus Christ.
1Jn1:4 And these things write we unto you, that your joy may be full.
1Jn1:5 This then is the message which we have heard of him, and declare unto you, that God is light, and in him is no darkness at all.
1Jn1:6 If we say that we have fellowship with him, and walk in darkness, we lie, and do not the truth:
"""


@pytest.fixture
def kjv_text() -> str:
    return KJV_SAMPLE


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A volume with v000001 and on-policy traffic in both formats (tests/training/
    distill_volume.py); built once per module."""
    return build_volume(tmp_path_factory.mktemp("distill"))


@pytest.fixture
def vol(base, tmp_path):
    """This test's own copy of ``base``."""
    return copy_volume(base, tmp_path)
