"""The retrieval environment's built-in documents: an invented archipelago, so no model knows the
answers from pretraining and a correct answer means the search worked. Each question's answer
is a short phrase that appears verbatim in exactly one document."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Doc:
    id: str
    title: str
    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Question:
    id: str
    question: str
    answer: str
    doc_id: str = ""
    """The document holding the answer ("" when unknown)."""


def _doc(id_: str, title: str, text: str) -> Doc:
    return Doc(id=id_, title=title, text=" ".join(text.split()))


DOCS: tuple[Doc, ...] = (
    _doc("kestrel-isles", "The Kestrel Isles", """The Kestrel Isles are an archipelago of eleven islands in
        the Pellucid Sea. The largest island is Varnholm and the capital is the harbour town of Ostry. The
        islands were first charted in 1612 by the navigator Ilse Marrow."""),
    _doc("varnholm", "Varnholm", """Varnholm is the largest of the Kestrel Isles, about 40 kilometres long.
        Its highest point is Mount Tessaly, 1,204 metres high. Most of the islands' barley is grown on the
        western plain of Varnholm."""),
    _doc("ostry", "Ostry", """Ostry is the capital of the Kestrel Isles and its busiest port. The town grew
        around a lighthouse called the Gannet Light, built in 1788. Ostry's market is held every Thursday."""),
    _doc("ilse-marrow", "Ilse Marrow", """Ilse Marrow was the navigator who first charted the Kestrel Isles in
        1612. She sailed on the ship Grey Heron and named the largest island after her home town of Varn.
        Her logbooks are kept in the Ostry Maritime Library."""),
    _doc("gannet-light", "The Gannet Light", """The Gannet Light is the lighthouse of Ostry, built in 1788 by
        the engineer Tobias Quell. Its lamp burned seal oil until 1851, when it was converted to paraffin.
        The light flashes green every six seconds."""),
    _doc("tobias-quell", "Tobias Quell", """Tobias Quell was an engineer born on Varnholm in 1751. Besides the
        Gannet Light he designed the Saltmarsh Bridge. He is buried in the churchyard of Lune."""),
    _doc("saltmarsh-bridge", "The Saltmarsh Bridge", """The Saltmarsh Bridge joins Varnholm to the island of
        Corra. It has nine stone arches and was finished in 1799. Tolls were charged on it until 1902."""),
    _doc("corra", "Corra", """Corra is the second largest of the Kestrel Isles. It is known for its slate
        quarries and for the Corra pony, a small breed with a silver mane. About 3,000 people live on
        Corra."""),
    _doc("corra-pony", "The Corra pony", """The Corra pony is a small horse breed from the island of Corra.
        Ponies of the breed are rarely taller than 12 hands and have a silver mane. They were used to haul
        slate from the quarries."""),
    _doc("lune", "Lune", """Lune is a fishing village on the east coast of Varnholm. Its church, St Brannoc's,
        has a bell cast in 1690. The village is famous for smoked mackerel."""),
    _doc("pellucid-sea", "The Pellucid Sea", """The Pellucid Sea lies between the mainland and the open
        ocean. Its waters are unusually clear, with visibility of up to 30 metres. The cold current that
        feeds it is called the Marrow Drift."""),
    _doc("marrow-drift", "The Marrow Drift", """The Marrow Drift is a cold ocean current flowing south through
        the Pellucid Sea. It is named after Ilse Marrow, who first described it. The current brings herring
        shoals to the Kestrel Isles every spring."""),
    _doc("herring-festival", "The Herring Festival", """The Herring Festival is held in Ostry on the first
        Saturday of May to welcome the spring shoals. The festival ends with the burning of a wicker fish
        called the Old Silver."""),
    _doc("kestrel-currency", "The kestrel mark", """The currency of the Kestrel Isles is the kestrel mark,
        divided into 100 pennings. Coins show a hovering kestrel on one side. The mark was introduced in
        1871, replacing the older quarter-crown."""),
    _doc("isles-parliament", "The Moot", """The Kestrel Isles are governed by an assembly called the Moot,
        which has 33 members. It meets in the Longhall in Ostry. Members are elected every four years."""),
    _doc("longhall", "The Longhall", """The Longhall is the meeting house of the Moot in Ostry. It was built
        of Corra slate in 1840. Its roof beams came from a wrecked ship, the Amberline."""),
    _doc("amberline", "The Amberline", """The Amberline was a merchant ship wrecked off Lune in 1836 during a
        winter gale. Its cargo was cinnamon and indigo. Timber from the wreck was used for the roof of the
        Longhall."""),
    _doc("maritime-library", "The Ostry Maritime Library", """The Ostry Maritime Library holds charts,
        logbooks and ship plans. Its oldest item is the logbook of the Grey Heron. The library's first
        librarian was Agnes Pell."""),
    _doc("agnes-pell", "Agnes Pell", """Agnes Pell was the first librarian of the Ostry Maritime Library,
        appointed in 1863. She compiled the first dictionary of the Kestrel dialect, which lists 4,000
        words."""),
    _doc("kestrel-dialect", "The Kestrel dialect", """The Kestrel dialect is spoken on the outer islands. In it
        a lighthouse is called a 'blinker' and the sea fog is called 'smirr'. It was first written down by
        Agnes Pell."""),
    _doc("smirr", "Smirr", """Smirr is the thick sea fog of the Kestrel Isles, most common in late summer. Ferry
        crossings to Corra are often cancelled because of it. In the Kestrel dialect the word also means a
        light drizzle."""),
    _doc("ferry", "The Corra ferry", """The Corra ferry runs between Ostry and Corra four times a day. The
        current vessel, the Puffin Queen, entered service in 1998. The crossing takes 50 minutes."""),
    _doc("tessaly", "Mount Tessaly", """Mount Tessaly is the highest point of the Kestrel Isles at 1,204
        metres. It is an extinct volcano. A stone cairn on its summit was raised in 1900 to mark the new
        century."""),
    _doc("barley", "Barley farming", """Barley is the main crop of the Kestrel Isles, grown mostly on the
        western plain of Varnholm. Most of the harvest goes to the Quillan distillery. The local variety is
        called Bere Gold."""),
    _doc("quillan-distillery", "The Quillan distillery", """The Quillan distillery near Ostry was founded in
        1825 by the brothers Fergus and Ewan Quillan. It makes a whisky aged in casks that held cherry wine.
        It is the only distillery on the islands."""),
    _doc("puffin-rock", "Puffin Rock", """Puffin Rock is the smallest of the eleven Kestrel Isles and has no
        permanent residents. About 20,000 puffins nest there each summer. Landing is allowed only in
        August."""),
    _doc("weather-station", "The Holm weather station", """The Holm weather station on Varnholm has recorded
        the islands' weather since 1880. Its strongest recorded gust was 187 kilometres per hour, in the
        storm of January 1953."""),
    _doc("storm-1953", "The storm of 1953", """The storm of January 1953 was the worst in the islands'
        records. It destroyed the old pier at Lune and flooded the Saltmarsh Bridge road. The Moot
        afterwards built a sea wall called the Mercy Wall."""),
    _doc("mercy-wall", "The Mercy Wall", """The Mercy Wall is a sea wall along the Ostry waterfront, finished
        in 1957 after the storm of 1953. It is 2.3 kilometres long. Its name comes from a line in a poem by
        Hester Vane."""),
    _doc("hester-vane", "Hester Vane", """Hester Vane was a poet born in Lune in 1921. Her best known
        collection is 'Salt and Tallow'. The Mercy Wall takes its name from her poem 'The Mercy of the
        Tide'."""),
    _doc("school", "The Ostry Academy", """The Ostry Academy is the islands' only secondary school, founded
        in 1867. Its motto is 'Steady as the Light'. Pupils from Corra board there during the week."""),
    _doc("islands-flag", "The flag of the Kestrel Isles", """The flag of the Kestrel Isles shows a white
        kestrel on a field of deep teal, with eleven small stars for the islands. It was adopted in
        1921."""),
)

QUESTIONS: tuple[Question, ...] = (
    Question(id="q1", question="In which year were the Kestrel Isles first charted?", answer="1612",
             doc_id="kestrel-isles"),
    Question(id="q2", question="What is the capital of the Kestrel Isles?", answer="Ostry", doc_id="ostry"),
    Question(id="q3", question="How high is Mount Tessaly, in metres?", answer="1,204", doc_id="tessaly"),
    Question(id="q4", question="What was the name of Ilse Marrow's ship?", answer="Grey Heron",
             doc_id="ilse-marrow"),
    Question(id="q5", question="Who built the Gannet Light?", answer="Tobias Quell", doc_id="gannet-light"),
    Question(id="q6", question="What colour does the Gannet Light flash?", answer="green", doc_id="gannet-light"),
    Question(id="q7", question="How many arches does the Saltmarsh Bridge have?", answer="nine",
             doc_id="saltmarsh-bridge"),
    Question(id="q8", question="What colour is the mane of the Corra pony?", answer="silver",
             doc_id="corra-pony"),
    Question(id="q9", question="What is the cold current that feeds the Pellucid Sea called?",
             answer="Marrow Drift", doc_id="pellucid-sea"),
    Question(id="q10", question="What is burned at the end of the Herring Festival?", answer="Old Silver",
             doc_id="herring-festival"),
    Question(id="q11", question="What currency did the kestrel mark replace?", answer="quarter-crown",
             doc_id="kestrel-currency"),
    Question(id="q12", question="How many members does the Moot have?", answer="33", doc_id="isles-parliament"),
    Question(id="q13", question="What cargo was the Amberline carrying?", answer="cinnamon and indigo",
             doc_id="amberline"),
    Question(id="q14", question="Who was the first librarian of the Ostry Maritime Library?",
             answer="Agnes Pell", doc_id="maritime-library"),
    Question(id="q15", question="What is a lighthouse called in the Kestrel dialect?", answer="blinker",
             doc_id="kestrel-dialect"),
    Question(id="q16", question="What is the name of the current Corra ferry?", answer="Puffin Queen",
             doc_id="ferry"),
    Question(id="q17", question="What is the local variety of barley called?", answer="Bere Gold",
             doc_id="barley"),
    Question(id="q18", question="In which year was the Quillan distillery founded?", answer="1825",
             doc_id="quillan-distillery"),
    Question(id="q19", question="In which month is landing on Puffin Rock allowed?", answer="August",
             doc_id="puffin-rock"),
    Question(id="q20", question="What was the strongest gust recorded at the Holm weather station, in km/h?",
             answer="187", doc_id="weather-station"),
    Question(id="q21", question="What sea wall was built after the storm of 1953?", answer="Mercy Wall",
             doc_id="storm-1953"),
    Question(id="q22", question="What is Hester Vane's best known collection?", answer="Salt and Tallow",
             doc_id="hester-vane"),
    Question(id="q23", question="What is the motto of the Ostry Academy?", answer="Steady as the Light",
             doc_id="school"),
    Question(id="q24", question="What colour is the field of the flag of the Kestrel Isles?", answer="deep teal",
             doc_id="islands-flag"),
    Question(id="q25", question="Where is the engineer Tobias Quell buried?", answer="Lune",
             doc_id="tobias-quell"),
    Question(id="q26", question="What fish is the village of Lune famous for?", answer="smoked mackerel",
             doc_id="lune"),
    Question(id="q27", question="How long does the Corra ferry crossing take, in minutes?", answer="50",
             doc_id="ferry"),
    Question(id="q28", question="In which year was the Longhall built?", answer="1840", doc_id="longhall"),
)
