"""The synthetic corpus's caption lexicon: per-language phrasings, modifiers, templates.

Data only — :mod:`training.data.synth` draws scenes and caption plans and renders
them with these tables. Adding a language means adding it to every table here
(``tests/training/test_synth.py`` checks that each table covers every language).

Western languages: (subject, verb[, complement]); jpn: (subject, dictionary form,
past form, -te iru form) with any object inside the verb; zho: (subject, verb phrase).
"""

from __future__ import annotations

Phrasing = tuple[str, ...]
LEXICON: dict[str, dict[str, list[Phrasing]]] = {
    "dog": {
        "eng": [("a dog", "barks"), ("a dog", "is barking")],
        "fra": [("un chien", "aboie"), ("un chien", "jappe")],
        "deu": [("ein Hund", "bellt"), ("ein Hund", "kläfft")],
        "spa": [("un perro", "ladra")],
        "nld": [("een hond", "blaft"), ("een hond", "keft")],
        "cat": [("un gos", "borda")],
        "jpn": [("犬", "吠える", "吠えた", "吠えている")],
        "zho": [("一只狗", "叫"), ("一只狗", "汪汪叫")],
    },
    "bell": {
        "eng": [("a bell", "rings"), ("a church bell", "chimes")],
        "fra": [("une cloche", "sonne"), ("une cloche d'église", "tinte")],
        "deu": [("eine Glocke", "läutet"), ("eine Kirchenglocke", "schlägt")],
        "spa": [("una campana", "suena"), ("una campana de iglesia", "repica")],
        "nld": [("een klok", "luidt"), ("een kerkklok", "slaat")],
        "cat": [("una campana", "sona"), ("una campana d'església", "repica")],
        "jpn": [("鐘", "鳴る", "鳴った", "鳴っている"), ("教会の鐘", "響く", "響いた", "響いている")],
        "zho": [("钟声", "响起"), ("教堂的钟声", "回荡")],
    },
    "siren": {
        "eng": [("a siren", "wails"), ("an emergency siren", "sounds")],
        "fra": [("une sirène", "hurle"), ("une sirène d'urgence", "retentit")],
        "deu": [("eine Sirene", "heult"), ("ein Martinshorn", "ertönt")],
        "spa": [("una sirena", "aúlla"), ("una sirena de emergencia", "suena")],
        "nld": [("een sirene", "loeit"), ("een sirene", "gilt")],
        "cat": [("una sirena", "udola"), ("una sirena d'emergència", "sona")],
        "jpn": [("サイレン", "鳴り響く", "鳴り響いた", "鳴り響いている"),
                ("緊急車両のサイレン", "鳴る", "鳴った", "鳴っている")],
        "zho": [("警笛", "鸣响"), ("救护车的警笛", "呼啸")],
    },
    "engine": {
        "eng": [("an engine", "hums"), ("a motor", "rumbles")],
        "fra": [("un moteur", "ronronne"), ("un moteur", "gronde")],
        "deu": [("ein Motor", "brummt"), ("ein Motor", "dröhnt")],
        "spa": [("un motor", "zumba"), ("un motor", "ruge")],
        "nld": [("een motor", "bromt"), ("een motor", "ronkt")],
        "cat": [("un motor", "brunzeix"), ("un motor", "ronca")],
        "jpn": [("エンジン", "うなる", "うなった", "うなっている"), ("モーター", "回る", "回った", "回っている")],
        "zho": [("发动机", "轰鸣"), ("一台马达", "嗡嗡作响")],
    },
    "rain": {
        "eng": [("rain", "falls"), ("rain", "patters")],
        "fra": [("la pluie", "tombe"), ("il", "pleut")],
        "deu": [("Regen", "prasselt"), ("es", "regnet")],
        "spa": [("la lluvia", "cae"), ("", "llueve")],
        "nld": [("regen", "klettert"), ("het", "regent")],
        "cat": [("la pluja", "cau"), ("", "plou")],
        "jpn": [("雨", "降る", "降った", "降っている"), ("雨", "降り注ぐ", "降り注いだ", "降り注いでいる")],
        "zho": [("雨", "下"), ("雨点", "落下")],
    },
    "bird": {
        "eng": [("a bird", "chirps"), ("a songbird", "sings")],
        "fra": [("un oiseau", "gazouille"), ("un oiseau", "chante")],
        "deu": [("ein Vogel", "zwitschert"), ("ein Singvogel", "singt")],
        "spa": [("un pájaro", "pía"), ("un pájaro", "canta")],
        "nld": [("een vogel", "tjilpt"), ("een zangvogel", "zingt")],
        "cat": [("un ocell", "piula"), ("un ocell", "canta")],
        "jpn": [("鳥", "さえずる", "さえずった", "さえずっている"), ("小鳥", "鳴く", "鳴いた", "鳴いている")],
        "zho": [("一只鸟", "鸣叫"), ("一只小鸟", "啼鸣")],
    },
    "clapping": {
        "eng": [("people", "clap"), ("an audience", "applauds")],
        "fra": [("des gens", "applaudissent"), ("un public", "applaudit")],
        "deu": [("Leute", "klatschen"), ("ein Publikum", "applaudiert")],
        "spa": [("la gente", "aplaude"), ("un público", "aplaude")],
        "nld": [("mensen", "klappen"), ("een publiek", "applaudisseert")],
        "cat": [("la gent", "aplaudeix"), ("un públic", "aplaudeix")],
        "jpn": [("人々", "拍手する", "拍手した", "拍手している"), ("観客", "拍手する", "拍手した", "拍手している")],
        "zho": [("人们", "鼓掌"), ("观众", "拍手")],
    },
    "water": {
        "eng": [("water", "trickles"), ("a stream", "babbles")],
        "fra": [("de l'eau", "coule"), ("un ruisseau", "murmure")],
        "deu": [("Wasser", "plätschert"), ("ein Bach", "plätschert")],
        "spa": [("el agua", "corre"), ("un arroyo", "murmura")],
        "nld": [("water", "kabbelt"), ("een beekje", "klatert")],
        "cat": [("l'aigua", "corre"), ("un rierol", "murmura")],
        "jpn": [("水", "流れる", "流れた", "流れている"),
                ("小川", "さらさらと流れる", "さらさらと流れた", "さらさらと流れている")],
        "zho": [("水", "流淌"), ("一条小溪", "潺潺流动")],
    },
    "whistle": {
        "eng": [("someone", "whistles"), ("a person", "whistles", "a tune")],
        "fra": [("quelqu'un", "siffle"), ("une personne", "siffle", "un air")],
        "deu": [("jemand", "pfeift"), ("eine Person", "pfeift", "eine Melodie")],
        "spa": [("alguien", "silba"), ("una persona", "silba", "una melodía")],
        "nld": [("iemand", "fluit"), ("iemand", "fluit", "een deuntje")],
        "cat": [("algú", "xiula"), ("una persona", "xiula", "una melodia")],
        "jpn": [("誰か", "口笛を吹く", "口笛を吹いた", "口笛を吹いている"),
                ("人", "口笛でメロディーを吹く", "口笛でメロディーを吹いた", "口笛でメロディーを吹いている")],
        "zho": [("有人", "吹口哨"), ("一个人", "用口哨吹着曲子")],
    },
    "drum": {
        "eng": [("a drum", "booms"), ("a drum", "is beaten")],
        "fra": [("un tambour", "résonne"), ("un tambour", "est frappé")],
        "deu": [("eine Trommel", "dröhnt"), ("eine Trommel", "wummert")],
        "spa": [("un tambor", "retumba"), ("un tambor", "resuena")],
        "nld": [("een trommel", "dreunt"), ("een trom", "roffelt")],
        "cat": [("un tambor", "retruny"), ("un tambor", "ressona")],
        "jpn": [("太鼓", "鳴る", "鳴った", "鳴っている"), ("ドラム", "ドンドンと響く", "ドンドンと響いた", "ドンドンと響いている")],
        "zho": [("一面鼓", "咚咚作响"), ("鼓", "被敲响")],
    },
    "alarm": {
        "eng": [("an alarm", "beeps"), ("an alarm clock", "goes off")],
        "fra": [("une alarme", "bipe"), ("un réveil", "sonne")],
        "deu": [("ein Alarm", "piept"), ("ein Wecker", "klingelt")],
        "spa": [("una alarma", "pita"), ("un despertador", "suena")],
        "nld": [("een alarm", "piept"), ("een wekker", "rinkelt")],
        "cat": [("una alarma", "xiscla"), ("un despertador", "sona")],
        "jpn": [("アラーム", "ピピッと鳴る", "ピピッと鳴った", "ピピッと鳴っている"),
                ("目覚まし時計", "鳴る", "鳴った", "鳴っている")],
        "zho": [("警报器", "嘀嘀作响"), ("闹钟", "响起")],
    },
    "wind": {
        "eng": [("the wind", "blows"), ("the wind", "howls")],
        "fra": [("le vent", "souffle"), ("le vent", "hurle")],
        "deu": [("der Wind", "weht"), ("der Wind", "heult")],
        "spa": [("el viento", "sopla"), ("el viento", "aúlla")],
        "nld": [("de wind", "waait"), ("de wind", "huilt")],
        "cat": [("el vent", "bufa"), ("el vent", "udola")],
        "jpn": [("風", "吹く", "吹いた", "吹いている"),
                ("風", "ビュービューと吹く", "ビュービューと吹いた", "ビュービューと吹いている")],
        "zho": [("风", "吹"), ("风", "呼呼作响")],
    },
    "telephone": {
        "eng": [("a phone", "rings"), ("a telephone", "rings")],
        "fra": [("un téléphone", "sonne")],
        "deu": [("ein Telefon", "klingelt"), ("ein Telefon", "läutet")],
        "spa": [("un teléfono", "suena"), ("un teléfono", "timbra")],
        "nld": [("een telefoon", "rinkelt")],
        "cat": [("un telèfon", "sona")],
        "jpn": [("電話", "鳴る", "鳴った", "鳴っている"), ("電話のベル", "鳴り響く", "鳴り響いた", "鳴り響いている")],
        "zho": [("电话", "响起"), ("一部电话", "铃铃作响")],
    },
    "knocking": {
        "eng": [("someone", "knocks", "on a door"), ("someone", "knocks", "on the door")],
        "fra": [("quelqu'un", "frappe", "à une porte"), ("quelqu'un", "frappe", "à la porte")],
        "deu": [("jemand", "klopft", "an eine Tür"), ("jemand", "klopft", "an die Tür")],
        "spa": [("alguien", "llama", "a una puerta"), ("alguien", "golpea", "la puerta")],
        "nld": [("iemand", "klopt", "op een deur"), ("iemand", "klopt", "op de deur")],
        "cat": [("algú", "truca", "a una porta"), ("algú", "pica", "a la porta")],
        "jpn": [("誰か", "ドアをノックする", "ドアをノックした", "ドアをノックしている")],
        "zho": [("有人", "敲门"), ("有人", "敲着门")],
    },
}

# Attribute wording per language: dim → value → synonyms.
MODIFIERS: dict[str, dict[str, dict[str, list[str]]]] = {
    "eng": {
        "loudness": {"loud": ["loudly"], "quiet": ["quietly", "softly"]},
        "rate": {"slow": ["slowly"], "fast": ["quickly", "rapidly"]},
        "pitch": {"high": ["at a high pitch", "with a high-pitched sound"],
                  "low": ["at a low pitch", "with a deep sound"]},
        "distance": {"far": ["in the distance", "far away"], "near": ["nearby", "close by"]},
    },
    "fra": {
        "loudness": {"loud": ["fort", "bruyamment"], "quiet": ["doucement", "faiblement"]},
        "rate": {"slow": ["lentement"], "fast": ["rapidement", "vite"]},
        "pitch": {"high": ["d'un son aigu", "dans les aigus"], "low": ["d'un son grave", "dans les graves"]},
        "distance": {"far": ["au loin", "dans le lointain"], "near": ["tout près", "à proximité"]},
    },
    "deu": {
        "loudness": {"loud": ["laut"], "quiet": ["leise"]},
        "rate": {"slow": ["langsam"], "fast": ["schnell", "zügig"]},
        "pitch": {"high": ["mit hohem Ton", "in hoher Tonlage"], "low": ["mit tiefem Ton", "in tiefer Tonlage"]},
        "distance": {"far": ["in der Ferne", "weit entfernt"], "near": ["ganz in der Nähe", "in der Nähe"]},
    },
    "spa": {
        "loudness": {"loud": ["fuerte", "con fuerza"], "quiet": ["suavemente", "débilmente"]},
        "rate": {"slow": ["lentamente", "despacio"], "fast": ["rápidamente", "deprisa"]},
        "pitch": {"high": ["con un tono agudo", "con un sonido agudo"],
                  "low": ["con un tono grave", "con un sonido grave"]},
        "distance": {"far": ["a lo lejos", "en la distancia"], "near": ["muy cerca", "cerca"]},
    },
    "nld": {
        "loudness": {"loud": ["luid", "hard"], "quiet": ["zacht", "zachtjes"]},
        "rate": {"slow": ["langzaam"], "fast": ["snel"]},
        "pitch": {"high": ["met een hoge toon", "met een hoog geluid"], "low": ["met een lage toon", "met een laag geluid"]},
        "distance": {"far": ["in de verte", "ver weg"], "near": ["dichtbij", "vlakbij"]},
    },
    "cat": {
        "loudness": {"loud": ["fort", "amb força"], "quiet": ["fluixet", "suaument"]},
        "rate": {"slow": ["lentament", "a poc a poc"], "fast": ["ràpidament", "de pressa"]},
        "pitch": {"high": ["amb un to agut", "amb un so agut"], "low": ["amb un to greu", "amb un so greu"]},
        "distance": {"far": ["a la llunyania", "de lluny"], "near": ["molt a prop", "a prop"]},
    },
    "jpn": {
        "loudness": {"loud": ["大きく", "大きな音で"], "quiet": ["小さく", "かすかに"]},
        "rate": {"slow": ["ゆっくりと", "のんびりと"], "fast": ["速く", "せわしなく"]},
        "pitch": {"high": ["高い音で", "甲高い音で"], "low": ["低い音で", "太い音で"]},
        "distance": {"far": ["遠くで", "離れた所で"], "near": ["すぐ近くで", "近くで"]},
    },
    "zho": {
        "loudness": {"loud": ["大声", "响亮"], "quiet": ["轻轻", "小声"]},
        "rate": {"slow": ["缓慢", "慢悠悠"], "fast": ["急促", "快速"]},
        "pitch": {"high": ["用高音", "以尖细的声音"], "low": ["用低音", "以低沉的声音"]},
        "distance": {"far": ["在远处", "在很远的地方"], "near": ["在近处", "就在附近"]},
    },
}

# Relation templates. Slots: {A} {B} {C} main clauses; deu/nld {X_inv} (verb first, after an adverb)
# and {X_sub} (verb last, subordinate); jpn {X} dictionary form, {X_past}, {X_teiru}; {count}.
TEMPLATES: dict[str, dict[str, list[str]]] = {
    "eng": {
        "single": ["{A}"],
        "repeat": ["{A} {count}, with pauses in between", "{A} {count}, with short breaks"],
        "then": ["{A}, then {B}", "first {A}, and then {B}", "{A}, and afterwards {B}"],
        "while": ["{A} while {B}", "{B} as {A}", "{A}, and at the same time {B}"],
        "sequence": ["{A}, then {B}, and finally {C}", "first {A}, then {B}, then {C}",
                     "{A}, after that {B}, and then {C}"],
        "then_while": ["{A}, then {B}, while {C} throughout", "while {C}, {A} and then {B}"],
    },
    "fra": {
        "single": ["{A}"],
        "repeat": ["{A} {count}, avec des pauses", "{A} {count}, en s'interrompant"],
        "then": ["{A}, puis {B}", "d'abord {A}, ensuite {B}", "{A}, et après {B}"],
        "while": ["{A} pendant que {B}", "{B} tandis que {A}", "{A}, et en même temps {B}"],
        "sequence": ["{A}, puis {B}, et enfin {C}", "d'abord {A}, ensuite {B}, puis {C}",
                     "{A}, après quoi {B}, et ensuite {C}"],
        "then_while": ["{A}, puis {B}, pendant que {C}", "pendant que {C}, {A}, puis {B}"],
    },
    "deu": {
        "single": ["{A}"],
        "repeat": ["{A} {count}, mit Pausen dazwischen", "{A} {count}, jeweils mit kurzer Pause"],
        "then": ["{A}, dann {B_inv}", "zuerst {A_inv}, danach {B_inv}", "{A}, anschließend {B_inv}"],
        "while": ["{A}, während {B_sub}", "{B}, während {A_sub}", "{A}, und gleichzeitig {B_inv}"],
        "sequence": ["{A}, dann {B_inv}, und schließlich {C_inv}", "zuerst {A_inv}, dann {B_inv}, danach {C_inv}",
                     "{A}, danach {B_inv}, und dann {C_inv}"],
        "then_while": ["{A}, dann {B_inv}, während {C_sub}", "während {C_sub}, {A_inv}, und dann {B_inv}"],
    },
    "spa": {
        "single": ["{A}"],
        "repeat": ["{A} {count}, con pausas entre medias", "{A} {count}, con breves pausas"],
        "then": ["{A}, luego {B}", "primero {A}, y después {B}", "{A}, y a continuación {B}"],
        "while": ["{A} mientras {B}", "{B} mientras {A}", "{A} y al mismo tiempo {B}"],
        "sequence": ["{A}, luego {B} y finalmente {C}", "primero {A}, después {B} y luego {C}",
                     "{A}, a continuación {B} y después {C}"],
        "then_while": ["{A} y luego {B}, mientras {C}", "mientras {C}, {A} y luego {B}"],
    },
    "nld": {
        "single": ["{A}"],
        "repeat": ["{A} {count}, met pauzes ertussen", "{A} {count}, telkens met een korte pauze"],
        "then": ["{A}, dan {B_inv}", "eerst {A_inv}, daarna {B_inv}", "{A}, en vervolgens {B_inv}"],
        "while": ["{A}, terwijl {B_sub}", "{B}, terwijl {A_sub}", "{A}, en tegelijkertijd {B_inv}"],
        "sequence": ["{A}, dan {B_inv}, en ten slotte {C_inv}", "eerst {A_inv}, dan {B_inv}, daarna {C_inv}",
                     "{A}, daarna {B_inv}, en dan {C_inv}"],
        "then_while": ["{A}, dan {B_inv}, terwijl {C_sub}", "terwijl {C_sub}, {A_inv}, en dan {B_inv}"],
    },
    "cat": {
        "single": ["{A}"],
        "repeat": ["{A} {count}, amb pauses entremig", "{A} {count}, amb petites pauses"],
        "then": ["{A}, després {B}", "primer {A}, i després {B}", "{A}, i a continuació {B}"],
        "while": ["{A} mentre {B}", "{B} mentre {A}", "{A} i alhora {B}"],
        "sequence": ["{A}, després {B} i finalment {C}", "primer {A}, després {B} i llavors {C}",
                     "{A}, a continuació {B} i després {C}"],
        "then_while": ["{A} i després {B}, mentre {C}", "mentre {C}, {A} i després {B}"],
    },
    "jpn": {
        "single": ["{A}"],
        "repeat": ["{A}音が{count}、間をおいて聞こえる", "{A}音が間隔をあけて{count}繰り返される"],
        "then": ["{A_past}後、{B}", "まず{A}音がして、次に{B}音がする", "{A}音に続いて、{B}音が聞こえる"],
        "while": ["{B_teiru}間に、{A}", "{B_teiru}中で、{A}", "{A}音と同時に、{B}音が聞こえる"],
        "sequence": ["{A}音、{B}音、{C}音が順に聞こえる", "まず{A}音がして、次に{B}音がして、最後に{C}音がする",
                     "{A_past}後、{B}音がして、最後に{C}音がする"],
        "then_while": ["{C_teiru}間に、{A_past}後、{B}", "{C_teiru}中、{A}音に続いて{B}音が聞こえる"],
    },
    "zho": {
        "single": ["{A}"],
        "repeat": ["{A}，重复了{count}，中间有停顿", "{A}，前后共{count}，每次之间有间隔"],
        "then": ["{A}，然后{B}", "先是{A}，接着{B}", "{A}之后，{B}"],
        "while": ["{B}的同时，{A}", "{A}，同时{B}", "在{B}的时候，{A}"],
        "sequence": ["{A}，然后{B}，最后{C}", "先是{A}，接着{B}，然后{C}", "{A}，之后{B}，最后{C}"],
        "then_while": ["{C}的同时，{A}，然后{B}", "在{C}的时候，先是{A}，接着{B}"],
    },
}

COUNTS: dict[str, dict[int, str]] = {
    "eng": {2: "twice", 3: "three times"}, "fra": {2: "deux fois", 3: "trois fois"},
    "deu": {2: "zweimal", 3: "dreimal"}, "spa": {2: "dos veces", 3: "tres veces"},
    "nld": {2: "twee keer", 3: "drie keer"}, "cat": {2: "dues vegades", 3: "tres vegades"},
    "jpn": {2: "2回", 3: "3回"}, "zho": {2: "两次", 3: "三次"},
}

# Background mention: suffix for Western languages, prefix for jpn/zho.
BACKGROUND: dict[str, list[str]] = {
    "eng": [", with background noise", ", over a noisy background"],
    "fra": [", avec un bruit de fond", ", sur un fond bruyant"],
    "deu": [", mit Hintergrundrauschen", ", vor lautem Hintergrundrauschen"],
    "spa": [", con ruido de fondo", ", sobre un fondo ruidoso"],
    "nld": [", met achtergrondruis", ", met veel ruis op de achtergrond"],
    "cat": [", amb soroll de fons", ", sobre un fons sorollós"],
    "jpn": ["雑音の中で、", "ノイズが混じる中、"],
    "zho": ["在嘈杂的背景中，", "背景噪音中，"],
}
ADVERB_JOIN = {"eng": " and ", "fra": " et ", "deu": " und ", "spa": " y ", "nld": " en ", "cat": " i "}
ASIAN = ("jpn", "zho")
